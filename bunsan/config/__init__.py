"""One typed config tree (root.py), its sections (sections.py) and the errors that name the fix (errors.py)."""

from bunsan.config.errors import ConfigError
from bunsan.config.root import Config

__all__ = ["Config", "ConfigError"]
