"""Pure plans: how a loop's steps are run, kept and re-run, as immutable actions (Revolve's
binomial schedule, periodic, multi-level and online plans), each checked by a simulator; nothing
here runs a model.
"""
