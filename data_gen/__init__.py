"""Stage 1: data generation (the seeded toy world and, later, regenerated/distilled data)."""
