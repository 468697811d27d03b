"""The stand-in's ``sglang.srt.distributed``: only ``gated_launch`` (SGLang 0.5.23's
distributed/gated_launch.py, called where distributed/bootstrap.py calls it)."""
