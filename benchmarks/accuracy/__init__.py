"""Training accuracy and stability studies: loss curves, seeds x learning rates, state formats."""
