from modserve.api import hookimpl


@hookimpl
def register_proposers(register) -> None:
    register(
        "ngram",
        "modserve.plugins.proposers.ngram:NgramProposer",
        options="modserve.plugins.proposers.ngram:NgramOptions",
        description="prompt lookup: continue the latest earlier match of the sequence's tail",
    )
    register(
        "draft_model",
        "modserve.plugins.proposers.draft_model:DraftModelProposer",
        options="modserve.plugins.proposers.draft_model:DraftModelOptions",
        description="a smaller checkpoint sharing the tokenizer drafts; its own KV on the target's blocks",
    )
