"""Model implementations (the Llama family), checkpoint loading, and the model generator."""
