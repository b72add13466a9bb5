"""Unlabelled text for masked-LM further pre-training (FedBFPT): the corpora (`text_corpora`,
MEDLINE abstracts via `pubmed`), their split over clients (`corpus_split`), the token sequences
cut from them, BERT's masking (`masking`) and each client's MLM batches (`mlm_batching`)."""
