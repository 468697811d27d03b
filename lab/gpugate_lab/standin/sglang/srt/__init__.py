"""The stand-in's ``sglang.srt``: ``server_args`` (SGLang's parser, from a snapshot of its flag table),
``weight_cache`` (the weight-cache daemon and its client) and ``distributed.gated_launch``."""
