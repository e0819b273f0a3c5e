"""What went wrong in an arithmetic dialogue (the ``arithmetic_dialogue`` environment's episodes): the
first of the model's turns whose number is not the running result.

A turn is what SPO over turns values and credits as one segment, so the credit measures
(:mod:`spo_verl.core.credit.blame`) take a wrong episode's "first wrong step" to start at the first token
of its first wrong turn: the blame on the error is then the share of the episode's negative advantage on
that turn and the turns after it, and the right steps are the right turns before it. The environment's
replies carry no advantage and are not in the loss, so they add nothing to either.
"""

from __future__ import annotations

from collections.abc import Sequence

from spo_verl.core.episodes.arithmetic import last_number, last_opening, operations_in


def first_wrong_turn(prompt: str, turns: Sequence[str], replies: Sequence[str]) -> int | None:
    """The index of the first of ``turns`` (the model's, in order) whose number (its last, as the
    environment reads it) is not the running result; ``None`` when every turn is right. The dialogue is
    the prompt's last opening and one operation from each of the environment's ``replies`` (the one
    after turn k gives turn k + 1's operation). Raises ``ValueError`` for a prompt or a reply that is not
    such a dialogue's."""
    value, first = last_opening(prompt)
    operations = [first]
    for reply in replies:
        found = operations_in(reply)
        if len(found) != 1:
            raise ValueError(f"an environment reply with {len(found)} operations: {reply!r}")
        operations.append(found[0])
    for k, (turn, (operator, number)) in enumerate(zip(turns, operations)):
        value = value + number if operator == "+" else value - number
        if last_number(turn) != value:
            return k
    return None


def turn_spans(environment: Sequence[bool]) -> tuple[list[range], list[range]]:
    """The model's turns and the environment's replies in a response, as token index ranges in order,
    from which of its tokens are the environment's."""
    turns: list[range] = []
    replies: list[range] = []
    start = 0
    for index in range(1, len(environment) + 1):
        if index == len(environment) or bool(environment[index]) != bool(environment[start]):
            (replies if environment[start] else turns).append(range(start, index))
            start = index
    return turns, replies


def first_wrong_turn_token(prompt: str, tokens: Sequence[str], environment: Sequence[bool],
                           score: float) -> tuple[int, int] | None:
    """:func:`first_wrong_turn` of an episode given as its response's token texts and which of them are
    the environment's: the first wrong turn (counted from 1) and the index of its first token. ``None`` for a right
    episode, and for a wrong one whose turns were all right (one that ended before its last operation,
    e.g. at the length limit): there is no wrong turn to place."""
    if len(tokens) != len(environment):
        raise ValueError(f"{len(tokens)} tokens but {len(environment)} environment flags")
    if score >= 1:
        return None
    turns, replies = turn_spans(environment)

    def text(span: range) -> str:
        return "".join(tokens[i] for i in span)

    # A reply after the model's last turn (an environment that ends the episode with a message) opens
    # no further turn.
    wrong = first_wrong_turn(prompt, [text(turn) for turn in turns],
                             [text(reply) for reply in replies[: max(len(turns) - 1, 0)]])
    return None if wrong is None else (wrong + 1, turns[wrong][0])
