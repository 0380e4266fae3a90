"""The error model's building blocks (no stage names here: verify/specs/ applies them per stage)."""
