"""What a run trains its model for besides the next token (train.objective): preference
pairs by DPO (jaxpar.objectives.dpo)."""
