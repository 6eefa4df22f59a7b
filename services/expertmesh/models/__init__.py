"""Checkpoints and the models made or found for them: the checkpoint reader, Hub ids, the embedded and tiny models,
the model families, the domain model, the tokenizer, the experts computed as a group holds them, and a model
named on the command line resolved to files."""
