"""NVIDIA Triton Inference Server: a model repository written from an artifact's metadata
(`repository`), and a local server around an artifact through PyTriton (`server`, `worker`)."""
