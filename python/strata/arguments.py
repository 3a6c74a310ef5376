"""strata.arguments: the command-line flags DeepSpeed scripts add to their own parser."""

import argparse


def add_config_arguments(parser):
    """Adds DeepSpeed's four flags to `parser` and returns it:

      --deepspeed            turn DeepSpeed (here: Strata) on; scripts test args.deepspeed
      --deepspeed_config F   the JSON config initialize(args=...) reads
      --deepscale, --deepscale_config F   the old names of the two above

    As DeepSpeed's, it adds no --local_rank: the `deepspeed` launcher passes --local_rank=R
    (unless --no_local_rank), and scripts declare it themselves, before or after this call; a
    script that does not reads LOCAL_RANK from the environment and is launched with
    --no_local_rank. A flag the parser already has is left as it is.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments(parser): expected an argparse.ArgumentParser, "
                        f"got {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by Strata)")
    taken = parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    if "--deepspeed" not in taken:
        group.add_argument("--deepspeed", default=False, action="store_true",
                           help="enable DeepSpeed (Strata) training")
    if "--deepspeed_config" not in taken:
        group.add_argument("--deepspeed_config", default=None, type=str,
                           help="DeepSpeed JSON configuration file")
    if "--deepscale" not in taken:
        group.add_argument("--deepscale", default=False, action="store_true",
                           help=argparse.SUPPRESS)
    if "--deepscale_config" not in taken:
        group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def config_from_args(args):
    """The config path initialize(args=...) uses: --deepspeed_config, else --deepscale_config."""
    if args is None:
        return None
    path = getattr(args, "deepspeed_config", None)
    if path is None:
        path = getattr(args, "deepscale_config", None)
    return path


__all__ = ["add_config_arguments", "config_from_args"]
