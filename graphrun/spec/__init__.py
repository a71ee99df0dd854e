"""The input contract: the spec's keys (pydantic), loading YAML with line:col, cross-key rules, paths."""
