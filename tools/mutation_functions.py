"""The functions tools/mutation.sh mutates, in mutmut's names (x_ + function, xǁClassǁ + method), per module.
Run as a script: mutmut's mutant-name patterns, one a line."""
FUNCTIONS = {
    "specdec": [
        "x_rejection_sample",                        # verification
        "xǁGatedDeltaNetǁforward",                   # commit / rollback: the verify stashes per-token inputs,
        "xǁGatedDeltaNetǁcommit",                    # the commit replays the accepted prefix
        "xǁQwen36ǁcommit",
        "xǁEngineǁ_emit",                            # stops
        "x_ngram_lookup",                            # ngram
        "xǁMTPProposerǁ_chain",                      # the MTP chain and its commit
        "xǁMTPProposerǁ_commit",
        "xǁMTPProposerǁcommit",
        "xǁSpeculativeConfigǁfrom_json",             # the speculative config's validation
        "xǁSpeculativeConfigǁ__post_init__",
    ],
    "kernels": [
        "x_gdn_recurrent_gated",                     # the replay on the CPU (the Triton kernels are not mutated)
        "x_gdn_recurrent_ref",
        "x_conv_window_ref",
    ],
}

if __name__ == "__main__":
    for module, names in FUNCTIONS.items():
        for name in names:
            print(f"{module}.{name}__mutmut_*")
