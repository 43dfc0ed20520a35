/* libpcaudio stand-in: eSpeak NG links it for playback, which synchronous synthesis never uses. */
#include <stddef.h>
struct audio_object;
struct audio_object *create_audio_device_object(const char *d, const char *a, const char *n) { return NULL; }
int audio_object_open(struct audio_object *o, int f, unsigned r, unsigned char c) { return -1; }
void audio_object_close(struct audio_object *o) {}
void audio_object_destroy(struct audio_object *o) {}
int audio_object_write(struct audio_object *o, const void *d, size_t b) { return -1; }
int audio_object_drain(struct audio_object *o) { return 0; }
int audio_object_flush(struct audio_object *o) { return 0; }
const char *audio_object_strerror(struct audio_object *o, int e) { return "no audio"; }
