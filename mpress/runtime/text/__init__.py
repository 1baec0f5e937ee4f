"""Text data for `data.kind: text`: documents from local files (`corpus`), a local or
trained tokenizer (`tokenizer`), and the packed, cached, split token windows (`packing`)."""
