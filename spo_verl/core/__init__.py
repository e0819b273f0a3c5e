"""SPO itself, free of verl, vLLM, Ray and TransferQueue: its settings and metadata, the maths, the
samplers, the packing of shared prefixes and the measures of where the blame lands."""
