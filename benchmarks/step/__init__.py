"""The whole train step: end to end, the optimizer step, profiles, floors, compile time."""
