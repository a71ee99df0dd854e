"""`graphrun init`: a first spec inferred from a sample of the data and the model."""
