"""specrl.drafters.kinds: the drafters the engine verifies, one module per kind: draft model (`draft_model.py`),
EAGLE-3 head (`eagle.py`), the parallel head drafting all k tokens in one forward (`parallel.py`), MTP heads
(`mtp.py`), n-gram prompt lookup (`ngram.py`), sibling suffix (`suffix.py`) and hybrid (`hybrid.py`: a learned
drafter with the suffix drafter). Each is built from a spec string through its row of the kinds table
(`specrl.drafters.registry`); how they are stored and made lives in `specrl.drafters.storage` and
`specrl.drafters.training`.
"""
