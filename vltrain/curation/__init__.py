"""Data curation for image-text corpora: deduplication, decontamination, filtering.

Modules: `text` (caption normalisation, word n-grams, seeded 64-bit hashes), `hashing`
(decoded-pixel content hash, pHash/dHash), `hamming` (multi-index Hamming search), `minhash`
(MinHash signatures, LSH with optimised bands/rows), `bloom` (a seeded, persistable Bloom
filter), `semantic` (embedding near-duplicates with a kept witness), `filters` (caption and
image sanity, CLIP-score selection), `pipeline` (`vltrain data curate`), `report`.
See docs/curation.md.
"""
