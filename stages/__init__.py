"""Stage runners (pretrain, continue, sft, dpo): see the stage-runner issue."""
