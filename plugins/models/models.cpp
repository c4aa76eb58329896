// The shipped model plugin: `gpt`, `llama`, `mlp`, `cnn`.
#include "models.hpp"

TESSERA_PLUGIN(model, TESSERA_VERSION, tessera::models::gpt_entry(), tessera::models::llama_entry(),
               tessera::models::mlp_entry(),
               tessera::models::cnn_entry());
