"""``vllm`` / ``python3 -m vllm.entrypoints.cli.main``: the CLI of the lab's vLLM stand-in, as
vllm/entrypoints/cli/main.py builds it: a FlexibleArgumentParser "vLLM CLI" with ``-v/--version``
and subcommands; the stand-in has ``serve`` (vllm/entrypoints/cli/serve.py: usage ``vllm serve
[model_tag] [options]``; a positional model tag wins over ``--model``) and ``preload``
(vllm/entrypoints/cli/preload.py: the weight cache's daemons, vllm/_weight_cache.py; its engine args
are the snapshot's, which is the serve parser's: a departure, the real one takes EngineArgs' only). A bad flag exits 2 with
argparse's message; no subcommand prints the help."""

import sys

DESCRIPTION = """Launch a local OpenAI-compatible API server to serve LLM
completions via HTTP. Defaults to Qwen/Qwen3-0.6B if no model is specified.

Search by using: `--help=<ConfigGroup>` to explore options by section (e.g.,
--help=ModelConfig, --help=Frontend)
  Use `--help=all` to show all available flags at once.
"""
EPILOG = ("For full list:            vllm {subcmd} --help=all\n"
          "For a section:            vllm {subcmd} --help=ModelConfig    (case-insensitive)\n"
          "For a flag:               vllm {subcmd} --help=max-model-len  (_ or - accepted)\n"
          "Documentation:            https://docs.vllm.ai\n")


def build_parser():
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI", epilog=EPILOG.format(subcmd="[subcommand]"))
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = subparsers.add_parser("serve", help="Launch a local OpenAI-compatible API server to serve LLM "
                                  "completions via HTTP.", description=DESCRIPTION,
                                  usage="vllm serve [model_tag] [options]")
    make_arg_parser(serve)
    serve.epilog = EPILOG.format(subcmd="serve")
    from vllm import _weight_cache
    from vllm.engine.arg_utils import AsyncEngineArgs

    preload = subparsers.add_parser("preload", help="Launch weight cache daemons (one per GPU) for fast engine "
                                    "restarts.", description="Launch weight cache daemons (one per GPU) that keep "
                                    "post-quantized weights in GPU memory and serve them to engines over CUDA IPC.",
                                    usage="vllm preload --model <model> [options]")
    AsyncEngineArgs.add_cli_args(preload)
    _weight_cache.add_preload_args(preload)
    preload.epilog = EPILOG.format(subcmd="preload")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.subparser == "preload":
        from vllm import _weight_cache

        return _weight_cache.preload(args)
    if args.subparser != "serve":
        parser.print_help()
        return 0
    # If model is specified in CLI (as positional arg), it takes precedence
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    from vllm import _api_server

    return _api_server.run_server(args)


if __name__ == "__main__":
    sys.exit(main())
