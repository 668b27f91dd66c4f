"""Draft heads: one implementation per algorithm (EAGLE-1, EAGLE-3), sized by the target config."""
