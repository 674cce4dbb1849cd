"""Data: tokenizers, token files, the built-in corpus, datasets, the global sampler, batch rebalancing.

Submodules are imported directly (`from ntp_nemo.data.sampler import GlobalBatchSampler`) so that
light users (the preprocessing command, the planner) do not pay for importing torch.
"""
