"""EAGLE-1 (Li et al., 2024): the head (`head`) and its Algorithm (`algorithm`)."""
