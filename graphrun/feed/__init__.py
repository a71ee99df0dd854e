"""The threads between read/, engine/ and write/: stage, launch, complete, in order."""
