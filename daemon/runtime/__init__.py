"""The bottom layer: small facts about the process and the machine that every other package may
use and that import none of them."""
