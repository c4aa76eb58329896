#pragma once
// The entries of the shipped model plugin, one per model family (see models.cpp).
#include "tessera/sdk/module.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::models {
sdk::PluginEntry gpt_entry();
sdk::PluginEntry llama_entry();
sdk::PluginEntry mlp_entry();
sdk::PluginEntry cnn_entry();
}  // namespace tessera::models
