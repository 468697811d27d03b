"""``python3 -m vllm.entrypoints.openai.api_server``: deprecated in vLLM 0.33.0 but still served
(vllm/entrypoints/openai/api_server.py warns twice, then runs vllm/entrypoints/launchers/api_server/
entry.py ``main``: a FlexibleArgumentParser "vLLM OpenAI-Compatible RESTful API server." with
``make_arg_parser``, ``--model`` as an option)."""

import sys
import warnings

warnings.warn("`vllm.entrypoints.openai.api_server` is deprecated and will likely be"
              "unsupported in a future version. Use the corresponding function from "
              "`vllm.entrypoints.launchers` instead.", DeprecationWarning, stacklevel=1)


def main():
    from vllm import _api_server
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(description="vLLM OpenAI-Compatible RESTful API server."))
    args = parser.parse_args()
    return _api_server.run_server(args)


if __name__ == "__main__":
    warnings.warn("The `python -m vllm.entrypoints.openai.api_server` command is deprecated "
                  "and may be removed in a future release. Please use `vllm server` instead.",
                  DeprecationWarning, stacklevel=1)
    sys.exit(main())
