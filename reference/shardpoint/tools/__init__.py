"""Tools on top of the API: the CLI, converters, diff and the demo. Nothing below imports them."""
