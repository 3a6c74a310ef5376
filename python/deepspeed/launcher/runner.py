"""deepspeed.launcher.runner: the `deepspeed` command, over strata-launch (strata.launcher)."""
import sys

from strata.launcher import DEEPSPEED_ENVIRONMENT_NAME, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
