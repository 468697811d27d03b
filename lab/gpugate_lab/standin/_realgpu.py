"""The lab's engine stand-ins on real hardware, what no engine owns (installed into a lab container as
``gpugate_standin_real``): the lab's mode, a tiny real model, greedy decoding, and the request loop
between a server's main process and the processes that hold the model.

A lab started with ``gpugate lab up --gpus real`` writes ``/run/gpugate-lab/gpu.json`` =
``{"mode": "real", "device": "cuda"}`` in each container (an engine's ``$<ENGINE>_STANDIN_GPU=real|cpu|sim``
overrides it). The model is a small randomly initialised transformer (transformers' ``LlamaForCausalLM``
from a config made in code, no weights downloaded; a few ``torch.nn`` layers when transformers is
missing); text is bytes as token ids. One JSON line each way carries a generation request from the
server's main process to a model holder and its answer (:class:`RealWorkers`, :func:`serve_requests`).
On a machine without a GPU the same code runs with ``device: cpu`` (tests): the "device" is this
machine's memory (:func:`open_device`).

Each engine's stand-in keeps its own rules (SGLang: sglang/_real.py, ``mem_fraction_static``; vLLM:
vllm/_model.py, ``gpu_memory_utilization``).

>>> decode(encode("hi"))
'hi'
"""

import json
import os
import sys
import threading
import time

MARKER = "gpu.json"
VOCAB = 32000
MAX_CONTEXT = 512
MAX_NEW_TOKENS = 256
MODEL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def lab_mode(forced="", ctl_dir=None):
    """``{"device": "cuda"|"cpu"}`` when the workers run for real, None for the simulation.

    ``forced`` (an engine's ``$<ENGINE>_STANDIN_GPU``): ``real`` (cuda), ``cpu``, ``sim``; else the
    lab's marker file.
    """
    forced = (forced or "").strip().lower()
    if forced in ("sim", "simulated"):
        return None
    if forced in ("real", "cuda"):
        return {"device": "cuda"}
    if forced == "cpu":
        return {"device": "cpu"}
    base = ctl_dir or os.environ.get("GPUGATE_LAB_CTL") or "/run/gpugate-lab"
    try:
        with open(os.path.join(base, MARKER)) as handle:
            doc = json.load(handle)
    except (OSError, ValueError):
        return None
    if isinstance(doc, dict) and doc.get("mode") == "real":
        return {"device": doc.get("device") or "cuda"}
    return None


def encode(text):
    """Bytes as token ids (3 + byte), the last MAX_CONTEXT of them; at least one token.

    >>> encode("ab")
    [100, 101]
    """
    ids = [3 + b for b in text.encode("utf-8", "replace")][-MAX_CONTEXT:]
    return ids or [1]


def decode(ids):
    """Token ids as text: bytes where they are printable ASCII, else ``<id>``.

    >>> decode([3 + 104, 3 + 105, 5000])
    'hi<5000>'
    """
    out = []
    for token in ids:
        byte = token - 3
        out.append(chr(byte) if 32 <= byte < 127 else "<%d>" % token)
    return "".join(out)


class RealWorkers:
    """Talks to the schedulers' request loops. Every rank decodes the same request (a TP group works
    on every request together); rank 0's tokens are the answer. One request at a time."""

    def __init__(self, procs):
        self.procs = procs
        self.lock = threading.Lock()

    def generate(self, text, max_new_tokens):
        request = json.dumps({"op": "generate", "ids": encode(text),
                              "max_new_tokens": max(0, min(int(max_new_tokens), MAX_NEW_TOKENS))}) + "\n"
        with self.lock:
            started = time.monotonic()
            for proc in self.procs:
                proc.stdin.write(request.encode())
                proc.stdin.flush()
            replies = []
            for proc in self.procs:
                line = proc.stdout.readline().decode(errors="replace")
                if not line:
                    raise RuntimeError("a scheduler died (no answer to a generation request)")
                replies.append(json.loads(line))
        first = replies[0]
        if not first.get("ok"):
            raise RuntimeError(first.get("error") or "generation failed")
        ids = first["ids"]
        return {"text": decode(ids), "ids": ids, "forward_s": first.get("forward_s"),
                "device": first.get("device"), "e2e_latency": time.monotonic() - started}


def _import_torch():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config; nothing is fetched
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch  # noqa: PLC0415 -- only the real mode needs it

    return torch


def build_model(torch, device, dtype, seed):
    """(model, description): transformers' Llama from a small config, else a few torch.nn layers."""
    torch.manual_seed(seed)
    try:
        from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

        config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_CONTEXT + MAX_NEW_TOKENS, **MODEL)
        model = LlamaForCausalLM(config)
        kind = "LlamaForCausalLM (transformers, random init)"

        def logits_of(ids):
            return model(input_ids=ids).logits[:, -1, :]
    except ImportError:
        nn = torch.nn
        hidden = MODEL["hidden_size"]

        class TinyLM(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(VOCAB, hidden)
                layer = nn.TransformerEncoderLayer(hidden, MODEL["num_attention_heads"], MODEL["intermediate_size"],
                                                   batch_first=True)
                self.layers = nn.TransformerEncoder(layer, MODEL["num_hidden_layers"])
                self.head = nn.Linear(hidden, VOCAB, bias=False)

            def forward(self, ids):
                return self.head(self.layers(self.embed(ids)))

        model = TinyLM()
        kind = "TinyLM (torch.nn, random init; transformers not installed)"

        def logits_of(ids):
            return model(ids)[:, -1, :]
    model = model.to(device=device, dtype=dtype).eval()
    return model, logits_of, kind


def greedy(torch, logits_of, ids, max_new_tokens, device):
    """Greedy decoding: ``max_new_tokens`` forward passes; the new token ids."""
    tokens = torch.tensor([ids], dtype=torch.long, device=device)
    out = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = logits_of(tokens[:, -MAX_CONTEXT:]).argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            out.append(int(nxt[0, 0]))
    return out


def open_device(torch, device_kind, gpu, cpu_total_env):
    """The device a model holder runs on: ``(device, free bytes now, total bytes, free_now(), held)``.
    CUDA: the context on device ``gpu`` (its index through ``CUDA_VISIBLE_DEVICES``) and the driver's
    figures. CPU: this machine's memory, ``$cpu_total_env`` MiB in all (default 512); ``held`` is where
    the caller keeps what it allocates, which ``free_now()`` counts."""
    held = []
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("No CUDA GPUs are available")
        if not 0 <= gpu < torch.cuda.device_count():
            raise RuntimeError("CUDA error: invalid device ordinal")
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
        torch.zeros(1, device=device)  # the CUDA context
        free, total = torch.cuda.mem_get_info(device)

        def free_now():
            return torch.cuda.mem_get_info(device)[0]
        return device, free, total, free_now, held
    device = torch.device("cpu")
    total = int(float(os.environ.get(cpu_total_env, "512")) * (1 << 20))

    def free_now():
        return total - sum(t.numel() * t.element_size() for t in held)
    return device, total, total, free_now, held


def serve_requests(torch, logits_of, device, say, lines):
    """Answer generation requests (``{"op": "generate", "ids", "max_new_tokens"}``, one JSON line each
    from ``lines``) with greedy decoding on ``device`` until ``lines`` ends (the parent is gone)."""
    for line in lines:
        try:
            request = json.loads(line)
            started = time.monotonic()
            ids = greedy(torch, logits_of, list(request["ids"]), int(request["max_new_tokens"]), device)
            if str(device).startswith("cuda"):
                torch.cuda.synchronize(device)
            say(json.dumps({"ok": True, "ids": ids, "forward_s": round(time.monotonic() - started, 6),
                            "device": str(device)}))
        except Exception as exc:  # noqa: BLE001 -- answer, keep serving
            say(json.dumps({"ok": False, "error": "%s: %s" % (type(exc).__name__, exc)}))


def own_pipe_stdout():
    """Keep fd 1 for the lines to the parent only: whatever torch or transformers print goes to the log.
    Returns the new ``sys.stdout``."""
    sys.stdout.flush()
    sys.stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return sys.stdout
