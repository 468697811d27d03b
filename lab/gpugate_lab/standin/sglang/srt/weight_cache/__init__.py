"""The stand-in's ``sglang.srt.weight_cache`` (SGLang 0.5.23): the weight-cache daemon and its client.

As in SGLang this package's ``__init__`` is empty of imports: import the submodules
(``protocol``, ``daemon``, ``ipc_loader``, ``transport``). See daemon.py.
"""
