#pragma once
// The C interface of libtessera_sentencepiece.so, the one library that links Debian's
// libsentencepiece. [Note: SentencePiece in its own namespace] libsentencepiece.so.0 embeds and
// exports its own protobuf-lite 3.14, while LibTorch loads libprotobuf 3.21: in one symbol
// scope either library binds the other's protobuf symbols and the process aborts ("compiled
// against version 3.14.0 ... installed version 3.21.12") or crashes at start. The toolkit
// therefore loads this shim with dlmopen(LM_ID_NEWLM), a separate link-map namespace with its own
// libstdc++ and libc: only plain C types cross, and memory the shim allocates is released by it.
#include <stddef.h>
#include <stdint.h>

extern "C" {

typedef struct TsppModel TsppModel;

/// A model from a serialized ModelProto, or null with *error set (release it with tspp_release).
TsppModel* tspp_load(const char* proto, size_t size, char** error);
void tspp_free(TsppModel* model);
/// Releases memory the shim returned (ids, text, error strings).
void tspp_release(void* pointer);

/// 0 on success: *ids (tspp_release) holds *count ids; else *error.
int tspp_encode(const TsppModel* model, const char* text, size_t size, int32_t** ids, size_t* count, char** error);
/// 0 on success: *text (tspp_release) holds *size bytes; else *error.
int tspp_decode(const TsppModel* model, const int32_t* ids, size_t count, char** text, size_t* size, char** error);

int tspp_piece_size(const TsppModel* model);
/// bos, eos, pad, unk ids (-1 when the model has none), in that order.
void tspp_special_ids(const TsppModel* model, int* bos, int* eos, int* pad, int* unk);
/// 1 when `id` is a control symbol or <unk>.
int tspp_is_special(const TsppModel* model, int id);
/// The piece of `id`, owned by the model.
const char* tspp_piece(const TsppModel* model, int id);

/// Trains with SentencePiece's trainer: `keys`/`values` are its flags (model_prefix, vocab_size,
/// ...); `next_line` returns 1 and a line, or 0 when there are no more. 0 on success, else *error.
int tspp_train(const char* const* keys, const char* const* values, size_t count,
               int (*next_line)(void* context, const char** line, size_t* size), void* context, char** error);
}
