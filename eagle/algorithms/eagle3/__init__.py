"""EAGLE-3 (Li et al., 2025): the head (`head`) and its Algorithm (`algorithm`)."""
