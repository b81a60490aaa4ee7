"""The YAML recipes shipped with salaquant (``salaquant recipes`` lists them)."""
