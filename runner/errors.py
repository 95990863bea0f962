"""Placeholder until the errors branch lands (replaced at merge)."""


class RunnerError(Exception):
    exit_code = 2
    outcome = "invalid"


class UserInputError(RunnerError, ValueError):
    pass


class ConfigValueError(UserInputError):
    """A run-level config value is out of range (names the field, the value and the fix)."""
