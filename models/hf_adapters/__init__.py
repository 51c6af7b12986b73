"""One adapter per Hugging Face `transformers` family (base.py says what each provides); models/hf.py
registers them by model_type and is the one way in: nothing here imports it."""
