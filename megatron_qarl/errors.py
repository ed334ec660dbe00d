"""Errors the `qarl` command reports as one line naming what was wrong (exit code 2)."""


class UserError(Exception):
    """Bad input from the user: a config key, a file and line, a command-line flag."""


class ConfigError(UserError):
    """A configuration value is wrong; the message starts with the dotted key."""
