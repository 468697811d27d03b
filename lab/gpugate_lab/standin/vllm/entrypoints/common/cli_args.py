"""``vllm.entrypoints.common.cli_args`` of the lab's stand-in: ``make_arg_parser``, the parser
``vllm serve`` parses (vllm/entrypoints/common/cli_args.py): the positional ``model_tag``, then every
option of the release's snapshot (vllm/engine/arg_utils.py here)."""

from vllm.engine.arg_utils import AsyncEngineArgs


def make_arg_parser(parser):
    """Create the CLI argument parser used by the OpenAI API server."""
    parser.add_argument("model_tag", type=str, nargs="?",
                        help="The model tag to serve (optional if specified in config)")
    return AsyncEngineArgs.add_cli_args(parser)
