"""The stand-in's ``sglang.srt``: only ``server_args`` (SGLang's parser, from a snapshot of its flag table)."""
