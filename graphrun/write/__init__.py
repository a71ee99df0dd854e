"""The write step: output shards (sinks/), rejects, the crash-safe journal, the folder's ownership and lock."""
