"""``vllm.utils.argparse_utils`` of the lab's stand-in: vLLM 0.33.0's FlexibleArgumentParser and its
switch action, as vllm/utils/argparse_utils.py has them (stdlib only).

- :class:`FlexibleArgumentParser`: an ``argparse.ArgumentParser`` that registers
  :class:`EnableDisableAction` for every ``BooleanOptionalAction``; ``parse_args`` takes ``_`` or
  ``-`` in option names, ``-O3`` as ``--optimization-level 3``, and for ``serve`` moves ``--model M``
  to the front as the positional model tag (with vLLM's warning); a bad flag exits 2 with argparse's
  message (vLLM adds a hint to a stray ``--task`` only);
- :class:`EnableDisableAction`: pairs ``--enable-x`` with ``--disable-x`` (``--no-...`` accepted
  but hidden);
- :func:`human_readable_int`, :func:`human_readable_int_or_auto`: ``1k`` = 1000, ``1K`` = 1024,
  ``-1``/``auto`` for the automatic max model length.

Not copied: ``--config`` YAML files (the stand-in has no yaml; gpugate refuses ``--config``) and the
dotted ``--json-arg.key value`` form.

>>> human_readable_int("25.6k"), human_readable_int("1K"), human_readable_int_or_auto("auto")
(25600, 1024, -1)
"""

import argparse
import re
import sys
from argparse import ArgumentParser, BooleanOptionalAction


def _warn(message, where="argparse_utils.py:394"):
    from vllm import _lab

    _lab.warning(where, message)


def human_readable_int(value):
    """Parse human-readable integers like '1k', '2M', etc. (decimal suffixes k m g t, binary K M G T)."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        decimal = {"k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "t": 10 ** 12}
        binary = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
        if suffix in decimal:
            return int(float(number) * decimal[suffix])
        try:
            return int(number) * binary[suffix]
        except ValueError:
            raise argparse.ArgumentTypeError(
                "Decimals are not allowed with binary suffixes like %s. Did you mean to use %s%s instead?"
                % (suffix, number, suffix.lower()))
    return int(value)


def human_readable_int_or_auto(value):
    value = value.strip()
    if value == "-1" or value.lower() == "auto":
        return -1
    return human_readable_int(value)


class EnableDisableAction(BooleanOptionalAction):
    """`BooleanOptionalAction` that pairs `--enable-x` with `--disable-x`.

    `--no-enable-x` and `--no-disable-x` are still accepted for backwards compatibility, but are
    hidden from help.
    """

    _inverse_prefixes = {"--enable-": "--disable-", "--disable-": "--enable-"}

    def __init__(self, option_strings, dest, *args, **kwargs):
        super().__init__(option_strings, dest, *args, **kwargs)
        inverses = [inverse + opt[len(prefix):] for opt in option_strings
                    for prefix, inverse in self._inverse_prefixes.items() if opt.startswith(prefix)]
        negated = {opt for opt in self.option_strings if opt not in option_strings}
        self.negative_option_strings = negated | set(inverses)
        self.visible_option_strings = [*option_strings, *inverses] if inverses else list(self.option_strings)
        self.option_strings = [*self.option_strings, *inverses]

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string not in self.negative_option_strings)


class FlexibleArgumentParser(ArgumentParser):
    """ArgumentParser that allows both underscore and dash in names."""

    def __init__(self, *args, **kwargs):
        kwargs.pop("add_json_tip", None)
        super().__init__(*args, **kwargs)
        self.register("action", BooleanOptionalAction, EnableDisableAction)
        self._show_serve_task_hint = False

    def error(self, message):
        if ((self.prog.endswith(" serve") or self._show_serve_task_hint)
                and message.startswith("unrecognized arguments:") and re.search(r"(^|\s)--task(=|\s|$)", message)):
            message += ("\n\nHint: --task is not a vllm serve option. For embedding, reranking, or reward "
                        "models, use --runner pooling. To adapt a generative model for pooling, also use "
                        "--convert embed, --convert classify, or --convert reward.")
        super().error(message)

    def add_argument(self, *args, **kwargs):
        kwargs.pop("deprecated", None)
        action = super().add_argument(*args, **kwargs)
        if isinstance(action, EnableDisableAction):  # hidden option strings stay registered
            action.option_strings = action.visible_option_strings
        return action

    def parse_args(self, args=None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        args = list(args)
        self._show_serve_task_hint = args[:1] == ["serve"] and any(re.match(r"^--task(=.+|$)", a) for a in args[1:])
        if args and args[0] == "serve":
            model_idx = next((i for i, arg in enumerate(args) if re.match(r"^--model(=.+|$)", arg)), None)
            if model_idx is not None:
                _warn("With `vllm serve`, you should provide the model as a positional argument or in a "
                      "config file instead of via the `--model` option. The `--model` option will be removed "
                      "in a future version.")
                if args[model_idx] == "--model":
                    model_tag, rest = (args[model_idx + 1] if model_idx + 1 < len(args) else ""), model_idx + 2
                else:
                    model_tag, rest = args[model_idx][len("--model="):], model_idx + 1
                args = ["serve", model_tag, *args[1:model_idx], *args[rest:]]
            if (len(args) > 1 and args[1].startswith("-") and not any(re.match(r"^--config(=.+|$)", a) for a in args)
                    and any(re.match(r"^--served[-_]model[-_]name(=.+|$)", a) for a in args)):
                raise ValueError("`model` should be provided as the first positional argument when using "
                                 "`vllm serve`. i.e. `vllm serve <model> --<arg> <value>`.")
        processed = []
        for i, arg in enumerate(args):
            if arg.startswith("--"):
                key, eq, value = arg.partition("=")
                key = "--" + re.sub(r"^[^.]*", lambda m: m.group(0).replace("_", "-"), key[2:], count=1)
                processed.append(key + eq + value)
            elif arg.startswith("-O") and arg != "-O":
                processed += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
            elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
                processed.append("--optimization-level")
            else:
                processed.append(arg)
        return super().parse_args(processed, namespace)
