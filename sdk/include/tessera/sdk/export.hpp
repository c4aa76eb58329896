#pragma once
/// Symbol visibility for the SDK library: its interfaces' type info must be shared by the
/// host and every plugin (exceptions and dynamic_cast cross the plugin boundary).
#define TESSERA_SDK_API __attribute__((visibility("default")))
