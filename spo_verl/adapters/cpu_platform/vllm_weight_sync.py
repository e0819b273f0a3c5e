"""The actor -> vLLM weight sync on vLLM's CPU backend (workaround 3 of ``workarounds``).

Runs inside vLLM's worker process as its worker extension. verl's own extension loads each bucket
with the model's ``load_weights``, which the CPU backend cannot do once its layers are in kernel
format; vLLM's ``reload_weights`` restores checkpoint format layer by layer, loads and re-processes.
"""

from __future__ import annotations

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension


class CPUWeightSyncExtension(vLLMColocateWorkerExtension):
    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
        if peft_config:
            raise NotImplementedError("spo_cpu platform: LoRA weight sync into vLLM's CPU backend is not supported")
        self.device = torch.device("cpu")
        received: list[tuple[str, torch.Tensor]] = []

        def on_bucket_received(weights, is_last):
            # Copies: the shared-memory bucket is reused for the next one.
            received.extend((name, tensor.clone()) for name, tensor in weights)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=on_bucket_received)
        self.reload_weights(weights_iterator=iter(received), is_checkpoint_format=True)  # vLLM's Worker method
