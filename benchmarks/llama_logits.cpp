// llama.cpp's logits at every position of one prompt, for benchmarks/bench_gguf_logits.py where
// llama-cpp-python is not installed: built there against the static libraries of bench_peers.py's
// llama.cpp build (llama.h's C API only).
//
//   llama_logits MODEL.gguf THREADS OUT.f32 ID [ID ...]
//
// writes float32 [n_ids, n_vocab] (row i: the logits after token i) to OUT.f32.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s MODEL THREADS OUT ID [ID ...]\n", argv[0]);
    return 2;
  }
  std::vector<llama_token> ids;
  for (int i = 4; i < argc; ++i) ids.push_back(static_cast<llama_token>(std::atoi(argv[i])));
  const int n = static_cast<int>(ids.size()), threads = std::atoi(argv[2]);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = n + 8, cp.n_batch = n, cp.n_ubatch = n, cp.n_seq_max = 1;
  cp.n_threads = threads, cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot make a context\n");
    return 1;
  }
  llama_batch batch = llama_batch_init(n, 0, 1);
  batch.n_tokens = n;
  for (int i = 0; i < n; ++i) {
    batch.token[i] = ids[i], batch.pos[i] = i, batch.n_seq_id[i] = 1, batch.seq_id[i][0] = 0;
    batch.logits[i] = 1;  // every position's output
  }
  if (llama_decode(ctx, batch) != 0) {
    std::fprintf(stderr, "llama_decode failed\n");
    return 1;
  }
  const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));
  FILE* out = std::fopen(argv[3], "wb");
  if (out == nullptr) return 1;
  for (int i = 0; i < n; ++i) std::fwrite(llama_get_logits_ith(ctx, i), sizeof(float), V, out);
  std::fclose(out);
  llama_batch_free(batch);
  llama_free(ctx);
  llama_model_free(model);
  return 0;
}
