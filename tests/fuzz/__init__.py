"""Property-based fuzzing of amp_fx.convert and the compiler backend (see docs/fuzzing.md)."""
