// Feed token ids straight to llama.cpp (no tokenizer, no BOS added) and print, as one JSON object on
// stdout: the logits of the last prompt position and a greedy continuation with per-step top-2 margins.
// Built and run by scripts/gguf_goldens.py. CPU only, 1 thread, f32 K/V cache, flash attention off.
// usage: llama_logits MODEL.gguf N_GREEDY ID,ID,...
#include "llama.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static void top2(const float * l, int n, int & best, float & margin) {
    best = 0;
    for (int i = 1; i < n; i++) if (l[i] > l[best]) best = i;  // ties: lowest id wins
    float second = -INFINITY;
    for (int i = 0; i < n; i++) if (i != best && l[i] > second) second = l[i];
    margin = l[best] - second;
}

int main(int argc, char ** argv) {
    if (argc != 4) { fprintf(stderr, "usage: %s MODEL.gguf N_GREEDY ID,ID,...\n", argv[0]); return 2; }
    const int n_greedy = atoi(argv[2]);
    std::vector<llama_token> ids;
    for (char * p = strtok(argv[3], ","); p; p = strtok(nullptr, ",")) ids.push_back(atoi(p));
    if (ids.empty()) return 2;

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "load failed\n"); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "context failed\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    std::vector<llama_token> prompt = ids;
    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), (int) prompt.size())) != 0) {
        fprintf(stderr, "decode failed\n"); return 1;
    }
    const float * last = llama_get_logits_ith(ctx, -1);
    std::vector<float> logits(last, last + n_vocab);

    std::vector<int> greedy;
    std::vector<float> margins;
    const float * cur = last;
    for (int s = 0; s < n_greedy; s++) {
        int best; float margin;
        top2(cur, n_vocab, best, margin);
        greedy.push_back(best);
        margins.push_back(margin);
        if (s + 1 == n_greedy) break;
        llama_token t = best;
        if (llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        cur = llama_get_logits_ith(ctx, -1);
    }

    printf("{\"n_vocab\": %d, \"last_logits\": [", n_vocab);
    for (int i = 0; i < n_vocab; i++) printf("%s%.9g", i ? ", " : "", logits[i]);
    printf("], \"greedy_tokens\": [");
    for (size_t i = 0; i < greedy.size(); i++) printf("%s%d", i ? ", " : "", greedy[i]);
    printf("], \"greedy_margins\": [");
    for (size_t i = 0; i < margins.size(); i++) printf("%s%.9g", i ? ", " : "", margins[i]);
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
