// Read bandwidth from memory with one and two threads (512 MB, best of five; 512-bit loads where built for AVX-512,
// 256-bit loads otherwise): what a one-token step, which streams every weight once, could reach at most. A probe of
// the machine, not of the engine.
//
//   gcc -O2 -fopenmp -mavx512f benches/probes/mem-bandwidth.c -o /tmp/mem-bandwidth && /tmp/mem-bandwidth
//   gcc -O2 -fopenmp -mavx2 benches/probes/mem-bandwidth.c -o /tmp/mem-bandwidth && /tmp/mem-bandwidth   (AVX2 only)
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#ifdef __AVX512F__
typedef __m512i vec;
#define ZERO() _mm512_setzero_si512()
#define LOAD(p) _mm512_load_si512(p)
#define ADD(a, b) _mm512_add_epi32(a, b)
static int total(vec s){ return _mm512_reduce_add_epi32(s); }
#else
typedef __m256i vec;
#define ZERO() _mm256_setzero_si256()
#define LOAD(p) _mm256_load_si256((const __m256i*)(p))
#define ADD(a, b) _mm256_add_epi32(a, b)
static int total(vec s){ int v[8]; _mm256_storeu_si256((__m256i*)v, s); int t=0; for(int i=0;i<8;i++)t+=v[i]; return t; }
#endif
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){ size_t n=512UL<<20, w=sizeof(vec); char*b=aligned_alloc(64,n); for(size_t i=0;i<n;i+=4096)b[i]=1; for(size_t i=0;i<n;i++)b[i]=i;
 for(int th=1;th<=2;th++){ double best=1e9; for(int rep=0;rep<5;rep++){ double t=now();
 #pragma omp parallel num_threads(th)
 { int id=omp_get_thread_num(); size_t per=n/th; const char*p=b+id*per; vec a0=ZERO(),a1=a0,a2=a0,a3=a0;
   for(size_t i=0;i<per;i+=4*w){ a0=ADD(a0,LOAD(p+i)); a1=ADD(a1,LOAD(p+i+w)); a2=ADD(a2,LOAD(p+i+2*w)); a3=ADD(a3,LOAD(p+i+3*w)); }
   if(total(ADD(ADD(a0,a1),ADD(a2,a3)))==7)puts("y"); }
 t=now()-t; if(t<best)best=t; }
 printf("%d threads: %.1f GB/s (%zu-bit loads)\n",th,n/best/1e9,8*w);} }
