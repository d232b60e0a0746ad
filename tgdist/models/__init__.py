"""M-TGNN building blocks (updaters, embeddings, predictors) and their assembly by injection
(``modules.build_model``): TGN, JODIE and APAN differ only by the modules they are given."""
