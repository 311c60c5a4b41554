"""regen's version, in a module of its own so that any part of regen can read it without importing the
package's entry points (regen/__init__.py imports the runtime and the learner)."""

__version__ = "0.1.0"
