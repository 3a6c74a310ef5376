"""deepspeed.utils.zero_to_fp32: a Strata checkpoint as one fp32 state_dict (strata.zero_to_fp32)."""
import sys

from strata.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,  # noqa: F401
                                 get_fp32_state_dict_from_zero_checkpoint,
                                 load_state_dict_from_zero_checkpoint, main)

if __name__ == "__main__":
    sys.exit(main())
