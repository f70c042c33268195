"""What tools/mutation.sh mutates, one group at a time: per group the functions (mutmut's names: x_ + function,
xǁClassǁ + method), per module, and the tests that run against them (a pytest -k expression: the fast, relevant
tests of test_specdec.py; mutmut then runs, for each mutant, those of them that call its function).

    python tools/mutation_functions.py groups                 the group names, one a line
    python tools/mutation_functions.py tests GROUP            the group's -k expression
    python tools/mutation_functions.py patterns GROUP         mutmut's mutant-name patterns, one a line
    python tools/mutation_functions.py mark GROUP DIR         in DIR's copies of the modules, every function and
                                                              method outside GROUP gets "# pragma: no mutate
                                                              block" on its header line (a comment: the code is
                                                              unchanged), so mutmut generates and traces only
                                                              the group's functions
"""
import ast
import io
import os
import sys
import tokenize

GROUPS = {
    "verify": dict(                                  # the verification: accept a prefix, add one token
        functions={"specdec": ["x_rejection_sample"]},
        tests="rejection_sampler"),
    "commit": dict(                                  # the commit / rollback: a verify stashes each GDN layer's
        functions={                                  # per-token inputs, the commit replays the accepted prefix
            "specdec": ["xǁGatedDeltaNetǁforward", "xǁGatedDeltaNetǁcommit", "xǁQwen36ǁcommit",
                        "xǁModelRunnerǁ_commit", "xǁModelRunnerǁ_spec_step"],
            "kernels": ["x_gdn_recurrent_gated", "x_gdn_recurrent_ref", "x_conv_window_ref"]},  # the CPU replay
        tests="rollback or gdn_recurrent_n_keep or verify_commit_with_oracle or accepted_draft_of_id_0 "
              "or hands_q_and_taps or (test_greedy_spec_equals_plain and (mtp2 or ngram3)) "
              "or fused_projections_equal_separate or gdn_chunked_equals_recurrent "
              "or (kernel_gdn_recurrent and not gpu)"),
    "stops": dict(                                   # stop handling: emit a step's tokens, stop where plain
        functions={"specdec": ["xǁEngineǁ_emit", "xǁEngineǁ_finish"]},        # decoding stops
        tests="stops_inside or step_returns or verify_commit_with_oracle or (test_greedy_spec_equals_plain and ngram)"),
    "ngram": dict(                                   # prompt lookup
        functions={"specdec": ["x_ngram_lookup", "xǁNgramProposerǁpropose"]},
        tests="ngram_lookup or ngram_drafts or proposer_without_an_engine "
              "or (test_greedy_spec_equals_plain and ngram)"),
    "mtp": dict(                                     # the MTP chain and its commit
        functions={"specdec": ["xǁMTPProposerǁprefill", "xǁMTPProposerǁ_chain", "xǁMTPProposerǁpropose",
                               "xǁMTPProposerǁ_commit", "xǁMTPProposerǁcommit", "x_draft_noise",
                               "x_draft_pick"]},
        tests="mtp_chain or proposer_without_an_engine or (test_greedy_spec_equals_plain and mtp)"),
    "config": dict(                                  # the speculative config's validation (SPEC_CHECKS' lambdas
        functions={"specdec": ["xǁSpeculativeConfigǁfrom_json", "xǁSpeculativeConfigǁcheck",  # are module-level:
                               "xǁSpeculativeConfigǁ_method", "xǁSpeculativeConfigǁ_lookup_window",  # mutmut
                               "xǁSpeculativeConfigǁconditional_rates", "x__positive_int"]},  # skips them)
        tests="spec_config"),
    "sampling": dict(                                # token sampling and the logits processors: the per-position
        functions={"specdec": ["x_per_row", "x_banned_tokens", "x_process_logits",  # processors, the target
                               "x_target_probs", "x_sample_from", "x_greedy_verify",  # distribution, the draws,
                               "x_synthetic_sample", "x_logprob_rows",  # greedy / synthetic verification,
                               "xǁSamplingParamsǁcheck"]},      # logprobs, SamplingParams' validation
        tests="top_k_top_p_masks or min_p_and_top_k_zero or rejection_sampler or logits_processors "
              "or bad_words_of or one_draft_verify or allowed_token_ids_on_every_row or integer_penalties "
              "or top_k_one or top_k_off or greedy_bound or min_p_one or target_probs or sample_from "
              "or synthetic_sample or sampling_params_cross or logprob_rows "
              "or cpu_greedy_accept or test_synthetic_acceptance_rates "
              "or greedy_spec_equals_plain_with_processors or n_samples_and_best_of "
              "or stops_inside_runs_match or truncate_prompt_tokens or test_request_errors "
              "or seeded_sampling or prompt_logprobs_equal or top_p_drops or row_without_filters "
              "or min_tokens_must"),
}
MODULES = ("specdec", "kernels")


def mangled(node, cls=None):
    return f"xǁ{cls}ǁ{node.name}" if cls else f"x_{node.name}"


def header_lines(source):
    """{mangled name: the line (1-based) of the ':' that ends its def header} for every top-level function and
    every method of a top-level class."""
    defs = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.lineno] = mangled(node)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs[sub.lineno] = mangled(sub, node.name)
    out, want, depth = {}, None, 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NAME and tok.string == "def" and tok.start[0] in defs and want is None:
            want, depth = defs[tok.start[0]], 0
        elif want is not None and tok.type == tokenize.OP:
            depth += tok.string in "([{"
            depth -= tok.string in ")]}"
            if tok.string == ":" and depth == 0:
                out[want] = tok.start[0]
                want = None
    return out


def mark(group, directory):
    keep = GROUPS[group]["functions"]
    for module in MODULES:
        path = os.path.join(directory, module + ".py")
        source = open(path, encoding="utf-8").read()
        lines = source.split("\n")
        for name, line in header_lines(source).items():
            if name not in keep.get(module, ()):
                lines[line - 1] += "  # pragma: no mutate block"
        open(path, "w", encoding="utf-8").write("\n".join(lines))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "groups":
        print("\n".join(GROUPS))
    elif what == "tests":
        print(GROUPS[sys.argv[2]]["tests"])
    elif what == "patterns":
        for module, names in GROUPS[sys.argv[2]]["functions"].items():
            for name in names:
                print(f"{module}.{name}__mutmut_*")
    elif what == "mark":
        mark(sys.argv[2], sys.argv[3])
